"""native: the C++ CPU expert executor (`native._ftnative`, built by `pip install` through setup.py,
or in place by `python native/build.py`), its checked Python front end (`native.ftnative`) and the
weight formats it reads (`native.formats`). The engine loads it lazily from `engine/moe/native.py`.
"""
