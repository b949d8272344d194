"""kubernetes-csi external-attacher in Python: ControllerPublish/Unpublish for VolumeAttachments."""
