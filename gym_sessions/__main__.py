"""``python -m gym_sessions`` runs the command line."""

import sys

from gym_sessions.cli import main

sys.exit(main())
