"""Engine settings the tests share."""

# The configuration whose greedy output equals transformers' and does not depend on the batch's
# shape: float32, dense weights. The fast default (bf16, the file's int4 codes where they win) is
# held to it within stated tolerances in test_quant.py.
EXACT = dict(dtype="float32", quantization="none")
