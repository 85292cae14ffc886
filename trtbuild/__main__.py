from trtbuild.cli import entry

if __name__ == "__main__":  # not when a spawned worker process imports the parent's main module
    entry()
