"""The baselines every plan must beat, named once for the whole advisor."""

#: configs that cost nothing in accuracy: the baselines a plan must beat
UNCOMPRESSED = ("none",)
SIXTEEN_BIT = ("fp16", "bf16")
BASELINES = UNCOMPRESSED + SIXTEEN_BIT
#: the config whose fidelity error is the budget where none is given or earned
DEFAULT_REFERENCE = "powersgd(rank=4)"
