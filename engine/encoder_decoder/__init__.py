"""Encoder-decoder models (T5 v1.0 / v1.1 / Flan-T5, BART, mBART): their own engine module.

spec.py (the families' block options), model.py (encoder and decoder stacks), convert.py (HF
tensors), build.py (OUTPUT/encoder + OUTPUT/decoder), runner.py (EncDecRunner: encoder runs, the
cross-KV pool, decoder steps), encoder_stage.py (the executor's hooks). docs/features/encoder_decoder.md.
"""
