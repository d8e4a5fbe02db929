"""``python -m gasloc_lightning.train``: the ``gasloc-train`` Hydra app (:mod:`gasloc_lightning.app.train`)."""

from gasloc_lightning.app.train import main

if __name__ == "__main__":
    main()
