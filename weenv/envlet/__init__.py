"""weenv.envlet"""
