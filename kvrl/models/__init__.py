"""The tiny reasoner: builder, pretraining job and shipped weights."""
