"""`python -m fastdeploy ...`: the same command as the `fastdeploy` console script."""
from fastdeploy.cli.main import main

if __name__ == "__main__":
    main()
