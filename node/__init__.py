"""The participant: model, data, inner training, the SparseLoCo outer step and the simulator."""
