"""``python -m fedrun``: the ``fedrun`` command (what ``torchrun -m fedrun`` starts on each rank)."""

from fedrun.cli import main

if __name__ == "__main__":
    main()
