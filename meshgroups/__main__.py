import sys

from meshgroups.cli.app import main

if __name__ == "__main__":
    sys.exit(main())
