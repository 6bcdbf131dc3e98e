"""`python train.py [KEY=VALUE ...]`: the same as `labrun train`, in this project."""

from labrun.cli.train import main

if __name__ == "__main__":
    main()
