"""ReMoE's method beside the model: the training objective and its routing statistics
(``losses``), the lambda controller of eq. 6 and its options (``sparsity``), the three training
stages (``stages``)."""
