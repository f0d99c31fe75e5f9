"""autopar.runtime"""
