import sys

from fedjax_opt.cli import main

sys.exit(main())
