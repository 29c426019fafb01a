"""ReMoE's method beside the model: the training objective, its routing statistics and the
lambda controller of eq. 6 with its options (``sparsity``), the three training stages
(``stages``)."""
