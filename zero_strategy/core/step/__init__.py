"""Old name of :mod:`zero_strategy.core.engine` (the room holding the engine and its optimizer step). Only the
module users were pointed at is kept: ``zero_strategy.core.step.loss_scaler``, which the README named for
``LossScalerConfig`` before the rename. Import from ``zero_strategy.core.engine`` instead."""
