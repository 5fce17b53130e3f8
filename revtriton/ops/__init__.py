"""Launchers, autograd Functions of fused ops, pure-torch references and dispatch."""
