from trtbuild.cli import main

if __name__ == "__main__":  # not when a spawned worker process imports the parent's main module
    main()
