"""trtbuild's version: recorded in every manifest (a leaf, so any module can read it)."""

__version__ = "0.1.0"
