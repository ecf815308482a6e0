"""`python -m kubellm.serve MODEL_DIR --name NAME --port 8080` (see kubellm.serve.server)."""

from kubellm.serve.server import main

main()
