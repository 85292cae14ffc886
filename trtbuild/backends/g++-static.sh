#!/bin/sh
# Inductor's C++ compiler when no compiler's libstdc++ is the process's (cxx.py): the compiled graph carries its own
# libstdc++ and hides it, so it cannot mix the compiler's headers with another runtime's library.
exec "${TRTBUILD_REAL_CXX:-g++}" "$@" -static-libstdc++ -static-libgcc -Wl,--exclude-libs,ALL
