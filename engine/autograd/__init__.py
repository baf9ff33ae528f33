"""Autograd and training: differentiable ops, losses, optimizers and a graph trainer."""

from engine.autograd.graph import GraphModel
from engine.autograd.losses import cross_entropy, mse
from engine.autograd.optim import SGD, Adam
from engine.autograd.tensor import Function, Tensor

__all__ = ["SGD", "Adam", "Function", "GraphModel", "Tensor", "cross_entropy", "mse"]
