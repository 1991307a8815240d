variable "aws_region" {
  description = "AWS region of this rollout region (replica bucket and worker nodes)."
  type        = string
}

variable "region_name" {
  description = "rlbus region name: the overlay under infra/regions/overlays and the workers' --region."
  type        = string
}

variable "replica_bucket" {
  description = "Name of this region's replica of the weights bucket (the workers' --store bucket)."
  type        = string
}

variable "weights_prefix" {
  description = "Key prefix of the weights, with its trailing slash; the same as in the central root."
  type        = string
  default     = "weights/"
}

variable "noncurrent_version_days" {
  description = "Days a replaced or deleted replica object stays as a noncurrent version."
  type        = number
  default     = 1
}

variable "cluster_name" {
  description = "Existing EKS cluster of this region that runs the worker fleet."
  type        = string
}

variable "node_role_arn" {
  description = "IAM role of the worker nodes (EKS worker, CNI and ECR read policies attached)."
  type        = string
}

variable "subnet_ids" {
  description = "Subnets of the node group; several zones widen the spot capacity pools."
  type        = list(string)
}

variable "instance_types" {
  description = "GPU instance types the spot node group may use; more types, fewer capacity gaps."
  type        = list(string)
  default     = ["g6.xlarge", "g6e.xlarge", "g5.xlarge"]
}

variable "ami_type" {
  description = "EKS AMI with the NVIDIA driver."
  type        = string
  default     = "AL2023_x86_64_NVIDIA"
}

variable "node_disk_gib" {
  description = "Root volume per node: the CUDA image alone is several GiB."
  type        = number
  default     = 200
}

variable "min_nodes" {
  description = "Fewest worker nodes (0 lets the region scale to nothing)."
  type        = number
  default     = 0
}

variable "max_nodes" {
  description = "Most worker nodes; keep at or above the overlay's replica count (one GPU per worker)."
  type        = number
  default     = 16
}
