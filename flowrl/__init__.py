"""flowrl: reinforcement learning for flow-matching image and video models.

Convention everywhere: ``sigma`` in [0, 1] with 1 = noise, ``x = (1 - sigma) x0 + sigma eps``,
``v = eps - x0``. Importing flowrl is light: diffusers, transformers and peft load on first use.
"""

__version__ = "0.1.0"

__all__ = ["__version__"]
