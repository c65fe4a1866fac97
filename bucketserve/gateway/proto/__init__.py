"""The serving API's .proto files and their generated stubs (see `regenerate.py`)."""
