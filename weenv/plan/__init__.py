"""weenv.plan"""
