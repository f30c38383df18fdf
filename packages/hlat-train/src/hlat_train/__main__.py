"""``python -m hlat_train`` (what ``torchrun -m hlat_train train ...`` runs)."""

from hlat_train.cli import run

if __name__ == "__main__":
    run()
