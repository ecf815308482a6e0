"""`python -m kubellm.serve MODEL_DIR --name NAME --port 8080` (see kubellm.serve.server)."""

from kubellm.process import exit_now
from kubellm.serve.server import main

main()
exit_now(0)  # without the interpreter's teardown (kubellm/process.py)
