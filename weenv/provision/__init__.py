"""weenv.provision"""
