"""Vision encoders of vision-language models: image pixels -> rows of a prompt-embedding table.

``registry.py`` maps a checkpoint's architecture to its family; ``encoder_dir.py`` writes and
loads the encoder directory beside the language engine; one module per family (``llava.py``)
over shared towers (``clip.py``).
"""
