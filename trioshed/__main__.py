import sys

from trioshed.cli import main

sys.exit(main())
