"""μP, the maximal-update parametrization ([mup]): hyperparameters tuned at a small width
(``base_dim``) carry over to wider models (docs/scaling.md).

``settings`` is the [mup] section (torch-free); ``parametrize`` classifies every parameter of
a family by which of its dimensions grow with width (from the family's own shapes at two
widths) and applies the table: initialization, the AdamW learning rate of each parameter,
the output multiplier and the attention scale.

May import: ``config``, ``models``, ``errors``.
"""
