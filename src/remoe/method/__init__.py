"""ReMoE's method beside the model: the training objective and its routing statistics, the lambda controller (eq. 6) and its options, the three training stages."""
