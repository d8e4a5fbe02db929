"""The Hydra config tree, shipped in the wheel as the package ``gasloc_lightning.conf``."""
