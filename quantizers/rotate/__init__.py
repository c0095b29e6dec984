"""The ``rotate:`` stage: function-preserving rotations before quantization. Its recipe config and the
families it rotates (config.py), the orthogonal matrices (matrices.py), the stage (stage.py) and its
torch-free plugin object (plugin.py); the weight rewrites it shares with the float references are
compress/rotation.py. Importing this package imports no torch."""
