"""autopar.core"""
