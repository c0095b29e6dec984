"""The GGUF export's file names and magic, named once (its spec, writer and input checks read them)."""

GGUF_FILE = "model.gguf"
GGUF_MAGIC = b"GGUF"
