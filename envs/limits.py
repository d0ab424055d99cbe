"""Server defaults the trainer's client shares (it splits its batches to fit them), and the
environment variables a server reads, importable without the web stack."""

MAX_BODY_BYTES = 1 << 20  # a request body past this answers 413
MAX_BATCH_OPS = 1024  # operations in one POST /batch; past this 413
MAX_ACTION_CHARS = 16 * 1024  # characters in one action (a whole model reply may be one); past this 400
MEMORY_SHARE = 0.8  # of the memory available at start-up, what a server may fill with instances

SECRET_ENV = "AGENTGYM_MEGA_SECRET"  # the shared secret, when no --secret-file is given
MEMORY_SHARE_ENV = "AGENTGYM_MEGA_MEMORY_SHARE"  # MEMORY_SHARE for a server started without --memory-share
