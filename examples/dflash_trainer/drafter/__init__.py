"""The drafter and what trains one replica of it: the model, the DFlash loss, the static-shape
step functions, the flat gradient buffer and the replica that owns optimizer and schedule."""
