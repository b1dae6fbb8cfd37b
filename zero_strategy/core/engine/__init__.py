"""The engine room: the engine and its optimizer step — building the engine, the step window (a lifecycle per
optimizer), the optimizer binding and fused steps, gradient maths, the unused-parameter agreement, the replica
average, the loss scaler, the release after training and the memory report."""
