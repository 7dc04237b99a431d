"""Operator tools: kvoffctl and kvoffd doctor, clients of the daemon like any other."""
