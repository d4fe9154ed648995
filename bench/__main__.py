import sys

from bench.serving import main

sys.exit(main())
