"""autopar.tools"""
