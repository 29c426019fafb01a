"""The lab: the paper's measurements built on the library.

``remoe.lab.analysis`` (``remoe analyze`` / ``remoe report``), ``remoe.lab.bench``
(``remoe bench``) and ``remoe.lab.study`` (``remoe study``) use the library packages beside
``remoe.lab`` (model, method, train, data, distributed, rundir, eval, convert, hf); no library
module imports the lab (tests/test_layering.py proves it).
"""
