"""Hugging Face packaging: a saved model directory is a complete, shareable HF repository.

:mod:`remoe.model.bundle` copies the model's code into the directory (generated from this package,
imports rewritten, so ``trust_remote_code=True`` loads it without remoe installed);
:mod:`remoe.rundir.card` writes its model card (the caller that saves writes it: remoe train,
remoe convert, ReMoETrainer). Kept import-light: the model imports the bundler lazily when it
saves itself.
"""
