"""`python -m kiln.runtime.tensor_parallel FD`: one tensor-parallel rank's process (rank.main)."""

from kiln.runtime.tensor_parallel.rank import main

if __name__ == "__main__":
    main()
