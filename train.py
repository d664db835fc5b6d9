"""`accelerate launch train.py [hydra overrides]`: train the EAGLE draft head (eagle_train.train)."""

from eagle_train.train import main

if __name__ == "__main__":
    main()
