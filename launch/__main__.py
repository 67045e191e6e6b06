import sys

from launch.stages import main

sys.exit(main())
