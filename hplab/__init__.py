"""hplab: learn how LLMs are trained on many devices, by building it."""
