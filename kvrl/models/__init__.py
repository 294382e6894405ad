"""The tiny reasoners: builder, shipped weights, the small random models of the tests.

:data:`SHIPPED` names the weights shipped in ``kvrl/models/weights`` by their ``model.path``
name, with the recipe that trains each (importing this package loads no model code).
"""

from pathlib import Path

WEIGHTS = Path(__file__).parent / "weights"
SHIPPED = {"tiny": (WEIGHTS / "tiny_reasoner", "tiny_pretrain"),
           "tiny-multihop": (WEIGHTS / "tiny_multihop", "tiny_multihop_pretrain")}
