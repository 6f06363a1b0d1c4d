import sys

from benchmarks.peers import main

sys.exit(main())
