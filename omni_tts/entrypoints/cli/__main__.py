import sys

from omni_tts.entrypoints.cli.commands import main

sys.exit(main())
